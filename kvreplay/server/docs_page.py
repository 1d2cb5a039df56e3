"""The OpenAPI docs page served with no network: Swagger UI's files come from the
`swagger-ui-bundle` package and are served by this server (FastAPI's own page loads them from a
CDN, which leaves it blank on a machine without internet access)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

STATIC_PREFIX = "/docs/static/"
PATHS = ("/docs", "/openapi.json")


def add_docs(app: FastAPI) -> None:
    """Serve Swagger UI at /docs over the app's /openapi.json, its scripts and styles from
    /docs/static/."""
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=str(swagger_ui_path)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs_page():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API docs",
                                   swagger_js_url=STATIC_PREFIX + "swagger-ui-bundle.js",
                                   swagger_css_url=STATIC_PREFIX + "swagger-ui.css",
                                   swagger_favicon_url=STATIC_PREFIX + "favicon-32x32.png")
