module github.com/tinybroker/tinybroker/examples/go-config-watcher

go 1.26.0

require github.com/tinybroker/tinybroker/clients/go v0.0.0

replace github.com/tinybroker/tinybroker/clients/go => ../../clients/go
