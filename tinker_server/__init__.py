"""The Tinker-compatible server: `unified tinker-serve`, the Tinker protocol over the torch kit.

The unmodified `tinker` SDK (and so the `tinker` backend, `backends/tinker/`) talks to it.
Modules, from the HTTP side in: `server` (the app, `LocalServer`, the command), `futures` (every
request resolves exactly once), `faults` (failures on purpose, for tests), `wire` (the protobuf
bodies), `service` (what each request does), `rest` and `catalog` (the `RestClient` side:
training runs, checkpoints, TTLs, weights export), `export` (exported model directories,
`age`-encrypted on request), `training` (a LoRA training model: Tinker's
losses, AdamW, saved state), `lora` (the adapters), `sampling` (sampling sessions on weight
snapshots), `compat` (every SDK method and loss: served, refused or client only; the docs table).
It imports `unified` and `torchkit`, never `backends`. Importing this package loads nothing.
"""
