"""Example loopmesh tools: see ``text_tools.tools``."""
