"""Model families: Cap, CapPa, CLIP*, SigLIP, CoCa, ClipCap."""
