"""The example configs, installed with shardbook as package data (``shardbook.configs``): no code here.

``shardbook configs`` lists them with their paths; ``kernel/api/configs.py`` resolves their short names
(``demo``, ``smollm2-135m``, ``qwen-8rank``, ``glm-744b-npu``, ``glm-744b-fp8-npu``) for ``%load_sharded``,
``shardbook chat`` and ``shardbook serve``.
"""
