"""The verl backend: verl's engine workers (FSDP2 on Ray) train, behind the same trainer.

Modules, from the data in to the workers: `convert` (trajectory groups -> verl's batch),
`algorithms` (our loss and advantage names on verl's `core_algos`), `config` (our config ->
verl's Hydra config), `worker` (verl's `TrainingWorker` plus two calls, inside Ray),
`worker_group` (the driver's handle on the workers), `backend` (`VerlBackend`), `cpu_platform`
(verl's platform hooks answered for CPU processes). This package imports nothing at import
time: `cpu_platform` is loaded from inside `import verl`.
"""
