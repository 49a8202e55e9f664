"""fedciuic's Flower ClientApp (one per region)."""
