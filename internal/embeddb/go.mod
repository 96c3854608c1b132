module github.com/pgfence/pgfence/internal/embeddb

go 1.26.0

require (
	github.com/fergusstrange/embedded-postgres v1.34.0
	github.com/lib/pq v1.10.9
)

require github.com/xi2/xz v0.0.0-20171230120015-48954b6210f8 // indirect
