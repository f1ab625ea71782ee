"""Protocol buffers of Tidepool's gRPC APIs; generated modules live beside their .proto files."""
