"""Tests that need an NVIDIA GPU (marked ``gpu``; skipped without one; run by
``make device-check``)."""
