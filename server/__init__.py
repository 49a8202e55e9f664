"""fedciuic's Flower ServerApp (the aggregator)."""
