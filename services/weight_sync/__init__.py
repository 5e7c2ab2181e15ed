"""The weight pipe, both ends: how a version leaves the trainer and reaches an engine.

A library like `sample_buffer` (no process of its own); the trainer, the engines and the
broker import it, and none of them imports another's folder.

- `wire`: weight buckets on ZMQ (a msgpack header frame, then raw tensor frames), their HMAC,
  the secret from `TANDEM_WEIGHT_SECRET`, `WeightSyncError`.
- `zmq_transport`: `ZmqWeightSender` (trainer -> broker intake) and `fetch_weights` (engine <-
  broker serve socket).
- `shm`: one-host shared-memory slots (the trainer writes, engines map them copy-on-write).
- `nccl_sender`: `NcclWeightSender`, the trainer's side of an NCCL (gloo on CPU) broadcast
  driven by the broker's coordinator.
- `process_group`: joining and leaving a weight-update group (trainer rank 0 and every engine
  rank), the rendezvous SGLang's `/init_weights_update_group` performs.
"""
