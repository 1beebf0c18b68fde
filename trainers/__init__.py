"""Models, losses, the data loader, the training loop and evaluation.

The bottom layer of capline (stages and pipeline may import it; it imports neither), so the shared
config tools (`configtools`) and user-facing errors (`errors`) live here too.
"""
