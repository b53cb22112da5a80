"""Prompt datasets in verl's parquet format and the tools that generate them."""
