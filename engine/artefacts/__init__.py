"""The artefact store, which the app, the CLI, the server and the build share (torch-free): where a build's files
live and their key (store, export_code), the user's view of them (cache), whether the disk has room (room), and
what a build reports while it runs (progress)."""
