"""KV movement between workers: one interface (``KvTransport``), three transports.

``shm`` (same host, CPU pools in shared memory), ``tcp`` (any host, ZMQ), ``cuda_ipc`` (same
host, GPU pools). Importing this package is light: it loads no transport, torch or zmq;
``registry.create_transport`` imports the chosen one.
"""
