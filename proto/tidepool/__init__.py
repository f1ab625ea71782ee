"""Tidepool's generated protobuf and gRPC modules (`make proto`), beside their .proto sources."""
