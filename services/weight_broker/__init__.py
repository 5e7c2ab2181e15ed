"""Weight broker: brings every inference engine to the trainer's newest weight version.

`broker.py` holds the ordering contract. Trainer side: `zmq_transport.ZmqWeightSender` (ZMQ frames,
or shared-memory slots on one host, `shm.py`) and `nccl_sender.NcclWeightSender`. Engine side:
`zmq_transport.fetch_weights` and `process_group.join_group`. Wire format: `wire.py`.
"""
