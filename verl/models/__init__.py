"""Model configs and model builders."""
