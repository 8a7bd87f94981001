"""Generated gRPC/protobuf code for the ``fastexp.v1`` contract (``make proto``; do not edit the *_pb2 files)."""
