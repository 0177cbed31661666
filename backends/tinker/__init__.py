"""The Tinker backend: `TinkerBackend`, the client that trains through the real `tinker` SDK.

`backend.py` trains through the SDK (the service, or any server speaking its protocol); `config.py`
is the `tinker:` section; `datums.py` turns trajectory groups into Tinker datums;
`server_process.py` starts the Tinker-compatible server (the `tinker_server` package, `unified
tinker-serve`) in a child process for offline runs. Importing this package loads nothing: import
the module you need.
"""
