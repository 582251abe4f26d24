"""KV connectors (kv/connector.py's KVConnector): how another worker's blocks reach this one.
zmq: direct worker to worker over ZeroMQ (a BlockServer on each prefill worker, a DEALER per fetch)."""
