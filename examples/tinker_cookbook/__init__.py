"""tinker-cookbook's own loops against `unified tinker-serve` (needs `tinker-cookbook==0.6.1`)."""
