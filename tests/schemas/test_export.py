from schemas.export import EXPORT_DIR, render


def test_the_checked_in_json_schemas_match_the_wire_types():
    rendered = render()
    on_disk = {p.name: p.read_text() for p in EXPORT_DIR.glob("*.json")}
    stale = sorted(
        name for name in rendered.keys() | on_disk.keys() if rendered.get(name) != on_disk.get(name)
    )
    assert not stale, (
        f"schemas/jsonschema/ is stale ({', '.join(stale)}): run `python -m schemas.export`"
    )


def test_every_exported_schema_is_titled_by_its_file_name():
    import json

    for name, text in render().items():
        assert json.loads(text)["title"] == name.removesuffix(".json")
