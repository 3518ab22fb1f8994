package kubevirtsim

import (
	"context"
	"maps"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// Faults injects the failures a host cluster can show. Switches kept in
// memory live here; the others are written to the objects themselves, as a
// real cluster would show them. Get it with Sim.Faults.
type Faults struct {
	c *cluster

	mu         sync.Mutex
	deny       map[string]string // volume or claim -> denial message
	notRunning map[string]bool   // VM key
	stuck      map[string]bool   // VM key

	// handler are virt-handler's own faults (set by Sim.New).
	handler *virthandler.Faults

	// What to wake when a switch flips (set by Sim.New).
	requeueVMs  func()
	requeueVMI  func(key string)
	requeuePods func(namespace, vm string)
	// holdMigration is the migration controller's (migration.go).
	holdMigration func(vmKey string, on bool)
}

func newFaults(c *cluster) *Faults {
	return &Faults{c: c, deny: map[string]string{}, notRunning: map[string]bool{}, stuck: map[string]bool{}}
}

func (f *Faults) wire(vms *vmController, vmis *vmiController, h *virtHandler, k *kubelet) {
	f.requeueVMs = vms.enqueueAll
	f.requeueVMI = func(key string) {
		vmis.queue.Add(key)
		h.queue.Add(key)
	}
	f.requeuePods = k.enqueueVM
	f.handler = h.vh.Faults()
}

// SetDeviceVanished makes the hot-plugged volume's block device vanish from
// under its attachment pod (a Longhorn volume that faulted under a running
// pod), or come back: a domain with the disk pauses on an I/O error, which
// delays virt-handler's updates of the VMI with growing waits, and mounting
// the volume from its pod fails (internal/virthandler Faults).
func (f *Faults) SetDeviceVanished(namespace, vm, volume string, on bool) {
	f.handler.SetDeviceVanished(namespace+"/"+vm, volume, on)
	f.requeueVMI(namespace + "/" + vm)
}

// SetUnmountFails makes virt-handler's unmount of the volume fail, or
// succeed again (internal/virthandler Faults).
func (f *Faults) SetUnmountFails(namespace, vm, volume string, on bool) {
	f.handler.SetUnmountFails(namespace+"/"+vm, volume, on)
	f.requeueVMI(namespace + "/" + vm)
}

func (f *Faults) deniedVolumes() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.deny)
}

func (f *Faults) isNotRunning(key string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.notRunning[key]
}

func (f *Faults) podsStuck(key string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stuck[key]
}

// DenyVolume makes the Harvester-like VM validator (WebhookHarvester) deny
// every VM update that adds a volume with this name or claim name, with 422
// and message (default "the volume <claim> is refused by an admission
// policy": a refusal for good; Harvester's own occupied-claim rule, which
// passes once the other VM lets go, is internal/simharvester's). It applies
// to client patches and to the legacy controller's spec updates alike.
func (f *Faults) DenyVolume(volume, message string) {
	f.mu.Lock()
	f.deny[volume] = message
	f.mu.Unlock()
}

// AllowVolume lifts DenyVolume and has the VM controller retry at once
// rather than after its backoff.
func (f *Faults) AllowVolume(volume string) {
	f.mu.Lock()
	delete(f.deny, volume)
	f.mu.Unlock()
	if f.requeueVMs != nil {
		f.requeueVMs()
	}
}

// SetVMINotRunning takes the VM's VMI out of phase Running (to Scheduled,
// with its hotplug machinery frozen) or back, and waits until the cache
// shows it. Subresource calls then get 409 "VMI is not running" and legacy
// requests wait.
func (f *Faults) SetVMINotRunning(ctx context.Context, namespace, vm string, notRunning bool) error {
	key := namespace + "/" + vm
	f.mu.Lock()
	f.notRunning[key] = notRunning
	f.mu.Unlock()
	f.requeueVMI(key)
	return waitVM(ctx, f.c, namespace, vm, func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		return vmi != nil && (vmi.Status.Phase == kubevirtv1.Running) != notRunning
	})
}

// SetAttachmentPodsStuck keeps the VM's attachment pods Pending (stuck) or
// lets them start.
func (f *Faults) SetAttachmentPodsStuck(namespace, vm string, stuck bool) {
	f.mu.Lock()
	f.stuck[namespace+"/"+vm] = stuck
	f.mu.Unlock()
	if !stuck {
		f.requeuePods(namespace, vm)
	}
}

// SetSnapshotInProgress writes vm.status.snapshotInProgress (empty clears
// it); while set, the VM validator denies volume changes with "Cannot update
// vm disks or volumes until snapshot "<s>" completes".
func (f *Faults) SetSnapshotInProgress(ctx context.Context, namespace, vm, snapshot string) error {
	err := retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur := &kubevirtv1.VirtualMachine{}
		if err := f.c.kv.get(ctx, resVMs, namespace, vm, cur); err != nil {
			return err
		}
		if snapshot == "" {
			cur.Status.SnapshotInProgress = nil
		} else {
			cur.Status.SnapshotInProgress = ptr.To(snapshot)
		}
		return f.c.kv.update(ctx, resVMs, namespace, vm, "status", cur, &kubevirtv1.VirtualMachine{})
	})
	if err != nil {
		return err
	}
	return waitVM(ctx, f.c, namespace, vm, func(v *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return v != nil && ptr.Deref(v.Status.SnapshotInProgress, "") == snapshot
	})
}

// SetMigrationInProgress starts (or ends) a simulated live migration in the
// VMI's status; while it runs the status validator denies volume requests.
func (f *Faults) SetMigrationInProgress(ctx context.Context, namespace, vm string, on bool) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur := &kubevirtv1.VirtualMachineInstance{}
		if err := f.c.kv.get(ctx, resVMIs, namespace, vm, cur); err != nil {
			return err
		}
		now := metav1.NewTime(time.Now().Add(-time.Second))
		if on {
			cur.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{
				StartTimestamp: &now, SourceNode: cur.Status.NodeName, TargetNode: cur.Status.NodeName + "-target",
			}
		} else if cur.Status.MigrationState != nil {
			cur.Status.MigrationState.EndTimestamp = &now
			cur.Status.MigrationState.Completed = true
		}
		return f.c.kv.update(ctx, resVMIs, namespace, vm, "status", cur, &kubevirtv1.VirtualMachineInstance{})
	})
}

// SetFeatureGates replaces the feature gates of the KubeVirt CR. The
// simulator follows the CR at run time, so this switches between legacy,
// declarative and no hotplug on a running simulator.
func (f *Faults) SetFeatureGates(ctx context.Context, gates []string) error {
	return f.c.setFeatureGates(ctx, gates)
}
