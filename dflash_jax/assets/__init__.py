"""What ships inside the package: the embedded default model's fetcher and the shipped drafters."""
