package simharvester

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// vmCache is the validator's view of the VMs: the informer's events, each
// applied lag after it arrived, in arrival order.
type vmCache struct {
	lag    time.Duration
	events chan vmEvent

	mu   sync.Mutex
	byNS map[string]map[string]*kubevirtv1.VirtualMachine
}

type vmEvent struct {
	due     time.Time
	vm      *kubevirtv1.VirtualMachine
	deleted bool
}

func newVMCache(lag time.Duration) *vmCache {
	return &vmCache{lag: lag, events: make(chan vmEvent, 4096), byNS: map[string]map[string]*kubevirtv1.VirtualMachine{}}
}

func (c *vmCache) handler() cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.arrive(obj, false) },
		UpdateFunc: func(_, obj any) { c.arrive(obj, false) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			c.arrive(obj, true)
		},
	}
}

func (c *vmCache) arrive(obj any, deleted bool) {
	vm, ok := obj.(*kubevirtv1.VirtualMachine)
	if !ok {
		return
	}
	if c.lag <= 0 {
		c.apply(vmEvent{vm: vm, deleted: deleted})
		return
	}
	// A full buffer only makes the informer wait, as a slow handler does.
	c.events <- vmEvent{due: time.Now().Add(c.lag), vm: vm, deleted: deleted}
}

// run applies the delayed events until ctx ends.
func (c *vmCache) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-c.events:
			if d := time.Until(ev.due); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
			}
			c.apply(ev)
		}
	}
}

func (c *vmCache) apply(ev vmEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ns := c.byNS[ev.vm.Namespace]
	if ns == nil {
		ns = map[string]*kubevirtv1.VirtualMachine{}
		c.byNS[ev.vm.Namespace] = ns
	}
	if ev.deleted {
		delete(ns, ev.vm.Name)
		return
	}
	ns[ev.vm.Name] = ev.vm
}

func (c *vmCache) list(namespace string) []*kubevirtv1.VirtualMachine {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*kubevirtv1.VirtualMachine, 0, len(c.byNS[namespace]))
	for _, vm := range c.byNS[namespace] {
		out = append(out, vm)
	}
	return out
}
