package driver

import (
	"context"
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

// nameLocks serializes the calls of one name within this process; unlike
// volumeLocks a second call waits its turn (or its context), so two calls
// that race for one name are both answered from what the first one left.
// An entry goes with its last waiter.
type nameLocks struct {
	mu    sync.Mutex
	locks map[string]*nameLock
}

type nameLock struct {
	turn chan struct{}
	refs int
}

func (l *nameLocks) lock(ctx context.Context, name string) (func(), error) {
	l.mu.Lock()
	if l.locks == nil {
		l.locks = map[string]*nameLock{}
	}
	e := l.locks[name]
	if e == nil {
		e = &nameLock{turn: make(chan struct{}, 1)}
		l.locks[name] = e
	}
	e.refs++
	l.mu.Unlock()
	select {
	case e.turn <- struct{}{}:
		return func() { <-e.turn; l.release(name, e) }, nil
	case <-ctx.Done():
		l.release(name, e)
		return nil, ctx.Err()
	}
}

func (l *nameLocks) release(name string, e *nameLock) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.refs--; e.refs == 0 {
		delete(l.locks, name)
	}
}
