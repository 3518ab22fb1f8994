package driver

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// volumeLocks keeps two operations off one volume at a time; a second one
// gets Aborted, as the CSI spec suggests, and the CO retries. The stale
// staging sweeper takes the same locks.
type volumeLocks struct {
	mu   sync.Mutex
	held map[string]bool
}

func newVolumeLocks() *volumeLocks { return &volumeLocks{held: map[string]bool{}} }

func (l *volumeLocks) tryLock(id string) (func(), bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[id] {
		return nil, false
	}
	l.held[id] = true
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.held, id)
	}, true
}

// lock is tryLock with the CSI answer for a busy volume.
func (l *volumeLocks) lock(id string) (func(), error) {
	release, ok := l.tryLock(id)
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is already in progress on this node", id)
	}
	return release, nil
}
