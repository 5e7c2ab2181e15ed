"""Weight broker: brings every inference engine to the trainer's newest weight version.

`broker.py` holds the ordering contract, the engine registry and the one sync loop;
`transports.py` the `WeightTransport` seam and its ZMQ and disk transports (`store.py` assembles
their versions); `nccl_transport.py` the NCCL one. Both ends of the pipe (trainer senders,
engine receivers) live in `services/weight_sync/`.
"""
