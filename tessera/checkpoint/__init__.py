"""The one checkpoint stack: format, atomic folders, resharding, training save/load, conversion,
Hugging Face export/import and inference loading."""
