"""The public entry points (`while_loop`, `scan`, `Loop`, the client adapters'
loop) and the checks of their static arguments. Imports the layers below."""
