"""The seam between fedciuic and Flower: message layout and process orchestration.

Everything else in :mod:`fedciuic` is plain Python, PyTorch and NumPy.
"""
