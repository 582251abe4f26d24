"""C sources (csrc/*.c, shipped as package data) and the one loader that builds them."""
