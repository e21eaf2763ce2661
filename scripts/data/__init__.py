"""Data and artifacts: the corpus, synthetic chats, the shipped demo pair, checkpoints, certificates, gRPC stubs."""
