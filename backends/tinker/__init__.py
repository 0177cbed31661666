"""The Tinker backend: `TinkerBackend` on the real `tinker` SDK, and a Tinker-compatible server.

`backend.py` trains through the SDK (the service, or any server speaking its protocol);
`server.py` is `unified tinker-serve`, the local server backed by the local backend's engine.
Importing this package loads neither: import the module you need.
"""
