"""The public APIs: OpenAI-compatible HTTP (`http.create_app`) and gRPC (`grpc.start_grpc_server`)."""
