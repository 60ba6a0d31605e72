"""Checkpoints: atomic DCP save/resume, export to HF safetensors, push to the Hub."""
