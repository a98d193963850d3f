"""kvfleet."""
