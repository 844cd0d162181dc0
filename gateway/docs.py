"""``/docs``: Swagger UI over ``/openapi.json``, its files served from the
``swagger-ui-bundle-v2`` package (Apache-2.0; Swagger UI 5, which reads OpenAPI 3.1).
Nothing is fetched from a CDN."""

from __future__ import annotations

import html
from pathlib import Path


def assets_dir() -> str:
    from swagger_ui_bundle import swagger_ui_path

    return str(Path(str(swagger_ui_path)))


def page(spec_url: str, assets: str) -> str:
    a, spec = html.escape(assets), html.escape(spec_url)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>loopmesh gateway API</title>
<link rel="stylesheet" href="{a}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{a}/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({{url: "{spec}", dom_id: "#swagger-ui", deepLinking: true}});
</script>
</body>
</html>
"""
