package migrations

import (
	"context"
	"database/sql"
)

// Unlock releases schema's migration lock on conn as Up's goose does once
// it has migrated: with ctx's cancellation and deadline stripped.
func Unlock(ctx context.Context, conn *sql.Conn, schema string) error {
	return sessionLocker(lockID(schema)).SessionUnlock(context.WithoutCancel(withCaller(ctx)), conn)
}

// Lock takes schema's migration lock on conn.
func Lock(ctx context.Context, conn *sql.Conn, schema string) error {
	return sessionLocker(lockID(schema)).SessionLock(ctx, conn)
}
