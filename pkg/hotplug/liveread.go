package hotplug

import (
	"context"
	"sync"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// liveReads shares the API server's VM and VMI lists between the workers.
// A worker that asks while a read is under way does not take that read (it
// began before the worker asked, so it may miss a write the worker must
// see); it waits for the next one, which starts as soon as the one under way
// ends and answers every worker that asked meanwhile. Every answer thus
// comes from a read begun after its worker asked, as fresh as the worker's
// own would have been, and a burst of batches on many VMs costs two reads
// instead of one per VM.
type liveReads struct {
	reader  Reader
	timeout time.Duration

	mu      sync.Mutex
	running *liveRead // under way; nil when idle
	next    *liveRead // starts when running ends; answers who asked meanwhile
	joined  int       // workers that took the next read instead of their own
}

type liveRead struct {
	done chan struct{}
	vms  []kubevirtv1.VirtualMachine
	vmis []kubevirtv1.VirtualMachineInstance
	err  error
}

// get returns a read of the VMs and VMIs begun after the call. The slices
// are shared: callers only read them.
func (l *liveReads) get(ctx context.Context) (*liveRead, error) {
	l.mu.Lock()
	var r *liveRead
	if l.running == nil {
		r = &liveRead{done: make(chan struct{})}
		l.running = r
		l.mu.Unlock()
		l.run(r)
	} else {
		if l.next == nil {
			l.next = &liveRead{done: make(chan struct{})}
		}
		r = l.next
		l.joined++
		l.mu.Unlock()
	}
	select {
	case <-r.done:
		return r, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// run makes read r, then starts the next one if anyone asked for it. A read
// is not tied to one caller's context (several wait on it); the timeout
// bounds it.
func (l *liveReads) run(r *liveRead) {
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	r.vms, r.err = l.reader.ListVMs(ctx)
	if r.err == nil {
		r.vmis, r.err = l.reader.ListVMIs(ctx)
	}
	cancel()
	close(r.done)
	l.mu.Lock()
	n := l.next
	l.running, l.next = n, nil
	l.mu.Unlock()
	if n != nil {
		go l.run(n)
	}
}
