"""The config: its schema (`schema`: dataclass sections whose fields check their own values), reading YAML and
`--section.key value` overrides (`parsing`), and the reference generated from the field docstrings (`reference`).

May import `rankd.control` (device names), nothing above it.
"""
