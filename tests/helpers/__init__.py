"""What several test modules share: running the command, scripted engines, small batches, a server."""
