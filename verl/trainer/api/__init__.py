"""The Python API's objects (docs/python_api.md), beside the trainers they drive; :mod:`verl.api` is their public
namespace."""
