"""Evaluations of pretrained encoders, as "Image Captioners Are Scalable Vision Learners Too" runs them."""
