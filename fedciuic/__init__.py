"""fedciuic: federated fine-tuning of DeepSeek models across jurisdictions, on Flower."""

__version__ = "0.1.0"
