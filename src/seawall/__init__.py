"""Seawall: a reliability gateway and control plane for LLM serving."""

__version__ = "0.1.0"
