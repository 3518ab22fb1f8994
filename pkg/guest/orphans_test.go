package guest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// orphanVMs is the host side as the reconciler sees it: what each VM holds,
// the attaches this process has in progress, and the detaches asked for.
type orphanVMs struct {
	mu        sync.Mutex
	held      map[string][]string
	attaching map[string]bool // vm/volume
	detached  []string
}

func (f *orphanVMs) Ready() bool { return true }

func (f *orphanVMs) VMs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for vm := range f.held {
		out = append(out, vm)
	}
	slices.Sort(out)
	return out
}

func (f *orphanVMs) View(vm string) hotplug.VMView {
	f.mu.Lock()
	defer f.mu.Unlock()
	return hotplug.VMView{Exists: true, Volumes: slices.Clone(f.held[vm])}
}

func (f *orphanVMs) DetachUnwantedBefore(_ context.Context, vm, volume string, deadline time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if deadline.IsZero() {
		return errors.New("no deadline")
	}
	if f.attaching[vm+"/"+volume] {
		return fmt.Errorf("volume %s on VM %s: %w", volume, vm, hotplug.ErrWanted)
	}
	f.detached = append(f.detached, vm+"/"+volume)
	f.held[vm] = slices.DeleteFunc(f.held[vm], func(v string) bool { return v == volume })
	return nil
}

func (f *orphanVMs) gone() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.detached)
}

func leaseUntil(context.Context) (time.Time, error) { return time.Now().Add(time.Minute), nil }

// orphanRig is a reconciler over fake guest and host sides with a clock the
// test moves.
type orphanRig struct {
	o     *Orphans
	vms   *orphanVMs
	ev    *fakeEvents
	now   time.Time
	first map[orphanKey]*orphanSeen
}

func newOrphanRig(t *testing.T, held map[string][]string, objs ...runtime.Object) (*orphanRig, *Nodes) {
	t.Helper()
	nodes, client := startNodes(t, objs...)
	nodes.SetVMUIDs(func(vm string) (types.UID, bool) { return types.UID("uid-" + vm), true })
	r := &orphanRig{vms: &orphanVMs{held: held, attaching: map[string]bool{}}, ev: &fakeEvents{}, now: time.Unix(1_000_000, 0), first: map[orphanKey]*orphanSeen{}}
	o, err := NewOrphans(OrphanConfig{Grace: time.Minute}, client, nodes, r.vms, r.ev, nil)
	if err != nil {
		t.Fatal(err)
	}
	o.now = func() time.Time { return r.now }
	r.o = o
	return r, nodes
}

// sweep looks once at the given time after the start.
func (r *orphanRig) sweep(t *testing.T, after time.Duration, confirm func(context.Context) (time.Time, error)) {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	r.now = time.Unix(1_000_000, 0).Add(after)
	if err := r.o.sweep(ctx, r.first, confirm); err != nil {
		t.Logf("sweep: %v", err)
	}
}

// Each way a hot-plug can be left without a VolumeAttachment, as the guest
// and host show it afterwards, and what the reconciler must leave alone.
func TestOrphanedHotplugs(t *testing.T) {
	mountedNode := guestNode("worker-1", "pvc-a") // kubelet still has it mounted
	notReady := awaiting(guestNode("worker-1"), "pvc-a")
	notReady.Status.Conditions[0].Status = corev1.ConditionUnknown
	namesake := guestNode("vm-1")
	namesake.Spec.ProviderID = ProviderIDPrefix + "uid-another-vm"
	for _, tc := range []struct {
		name string
		objs []runtime.Object
		// attaching: the driver attaches pvc-a to vm-1 right now.
		attaching bool
		want      []string
	}{
		{name: "VolumeAttachment deleted by hand, or publish answered after its caller gave up, or a crash after the write: removed",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a")}, want: []string{"vm-1/pvc-a"}},
		{name: "Node found by providerID only (node plugin down): removed",
			objs: []runtime.Object{withProvider(guestNode("worker-1"), "vm-1"), guestPV("pvc-a")}, want: []string{"vm-1/pvc-a"}},
		{name: "forced detach while kubelet still has it mounted: kept",
			objs: []runtime.Object{mountedNode, csiNode("worker-1", "vm-1"), guestPV("pvc-a")}},
		{name: "forced detach from a Node that is not Ready and lists it in use: kept",
			objs: []runtime.Object{notReady, csiNode("worker-1", "vm-1"), guestPV("pvc-a")}},
		{name: "a VolumeAttachment asks for it on the VM's Node: kept",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a"), attachment("pvc-a", "worker-1", "vm-1")}},
		{name: "a VolumeAttachment without the attacher's record on a Node that is the VM's by providerID only: kept",
			objs: []runtime.Object{withProvider(guestNode("worker-1"), "vm-1"), guestPV("pvc-a"), unrecorded(attachment("pvc-a", "worker-1", "vm-1"))}},
		{name: "its VolumeAttachment is being deleted (the attacher detaches it): kept",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a"), deleting(attachment("pvc-a", "worker-1", "vm-1"), time.Now())}},
		{name: "a VolumeAttachment wants it on another VM: removed from this one",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestNode("worker-2"), csiNode("worker-2", "vm-2"), guestPV("pvc-a"), attachment("pvc-a", "worker-2", "vm-2")},
			want: []string{"vm-1/pvc-a"}},
		{name: "being published right now without a VolumeAttachment: kept",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a")}, attaching: true},
		{name: "guest Node deleted: the VM is no longer provably this cluster's: kept",
			objs: []runtime.Object{guestPV("pvc-a")}},
		{name: "a VM that only shares its name with a Node of this cluster: kept",
			objs: []runtime.Object{namesake, guestPV("pvc-a")}},
		{name: "a volume no guest PV of this cluster names (another cluster's): kept",
			objs: []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := newOrphanRig(t, map[string][]string{"vm-1": {"pvc-a"}}, tc.objs...)
			r.vms.attaching["vm-1/pvc-a"] = tc.attaching
			r.sweep(t, 0, leaseUntil)
			if got := r.vms.gone(); len(got) > 0 {
				t.Fatalf("removed %v before the grace period", got)
			}
			r.sweep(t, 2*time.Minute, leaseUntil)
			if got := r.vms.gone(); !slices.Equal(got, tc.want) {
				t.Fatalf("removed %v, want %v", got, tc.want)
			}
			if got := testutil.ToFloat64(r.o.removed); got != float64(len(tc.want)) {
				t.Errorf("removed counter %v, want %d", got, len(tc.want))
			}
			events := r.ev.list()
			if len(tc.want) > 0 && (len(events) != 1 || events[0].reason != "OrphanedVolumeRemoved" || events[0].node != "worker-1") {
				t.Errorf("events %+v, want one OrphanedVolumeRemoved on worker-1", events)
			}
			if len(tc.want) == 0 && len(events) > 0 {
				t.Errorf("events %+v for nothing removed", events)
			}
		})
	}
}

// unrecorded is a VolumeAttachment before the attacher recorded its node ID.
func unrecorded(va *storagev1.VolumeAttachment) *storagev1.VolumeAttachment {
	va.Annotations = nil
	return va
}

func withProvider(n *corev1.Node, vm string) *corev1.Node {
	n.Spec.ProviderID = ProviderIDPrefix + "uid-" + vm
	return n
}

// A guest Node deleted and registered again (kubelet re-creates its Node)
// makes the VM this cluster's again, and its orphan is removed; the grace
// counts from when it was first seen as this cluster's.
func TestOrphanOfANodeDeletedAndBack(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	r, nodes := newOrphanRig(t, map[string][]string{"vm-1": {"pvc-a"}}, guestPV("pvc-a"))
	r.sweep(t, 0, leaseUntil)
	r.sweep(t, 2*time.Minute, leaseUntil)
	if got := r.vms.gone(); len(got) > 0 {
		t.Fatalf("removed %v from a VM no Node of this cluster runs on", got)
	}
	if _, err := nodes.client.CoreV1().Nodes().Create(ctx, guestNode("worker-1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := nodes.client.StorageV1().CSINodes().Create(ctx, csiNode("worker-1", "vm-1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the Node registered again", 10*time.Second, func() bool { return len(nodes.NodesOfVM("vm-1")) == 1 })
	r.sweep(t, 3*time.Minute, leaseUntil)
	if got := r.vms.gone(); len(got) > 0 {
		t.Fatalf("removed %v before its grace period as this cluster's", got)
	}
	r.sweep(t, 4*time.Minute, leaseUntil)
	if got := r.vms.gone(); !slices.Equal(got, []string{"vm-1/pvc-a"}) {
		t.Fatalf("removed %v, want vm-1/pvc-a", got)
	}
}

// A replica whose Lease check fails writes nothing, and a VolumeAttachment
// that only a fresh list shows (the cache lags) keeps the volume.
func TestOrphanChecksBeforeRemoving(t *testing.T) {
	objs := []runtime.Object{guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a")}
	r, nodes := newOrphanRig(t, map[string][]string{"vm-1": {"pvc-a"}}, objs...)
	deposed := func(context.Context) (time.Time, error) { return time.Time{}, errDeposed }
	r.sweep(t, 0, deposed)
	r.sweep(t, 2*time.Minute, deposed)
	if got := r.vms.gone(); len(got) > 0 {
		t.Fatalf("a deposed replica removed %v", got)
	}
	// The VolumeAttachment is on the API server, not yet in the cache.
	nodes.client.(*fake.Clientset).PrependReactor("list", "volumeattachments", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, &storagev1.VolumeAttachmentList{Items: []storagev1.VolumeAttachment{*attachment("pvc-a", "worker-1", "vm-1")}}, nil
	})
	r.sweep(t, 3*time.Minute, leaseUntil)
	if got := r.vms.gone(); len(got) > 0 {
		t.Fatalf("removed %v although a fresh list shows its VolumeAttachment", got)
	}
	if len(nodes.cachedAttachments()) != 0 {
		t.Fatal("the cache shows the VolumeAttachment: the test checks nothing")
	}
}
