"""Local backend: bubblewrap sandboxes run by a detached supervisor per batch."""
