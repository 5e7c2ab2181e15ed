"""Weight broker: brings every inference engine to the trainer's newest weight version
(`broker.py`: the engines and the loop; `transports.py`, `nccl_transport.py`: how versions
travel). Both ends of the pipe, trainer senders and engine receivers, are services/weight_sync/.
"""
