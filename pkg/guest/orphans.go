package guest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// Defaults of OrphanConfig.
const (
	DefaultOrphanGrace    = 2 * time.Minute
	DefaultOrphanInterval = 30 * time.Second
)

// OrphanConfig tunes the orphan reconciler. Zero fields take the defaults.
type OrphanConfig struct {
	// Grace is how long the elected replica must see a hot-plug that no
	// VolumeAttachment asks for before it removes it (2 min).
	Grace time.Duration
	// Interval is the time between two looks at every VM (30 s).
	Interval time.Duration
	// DetachTimeout bounds the wait for one removal (2 min).
	DetachTimeout time.Duration
}

func (c OrphanConfig) withDefaults() OrphanConfig {
	if c.Grace <= 0 {
		c.Grace = DefaultOrphanGrace
	}
	if c.Interval <= 0 {
		c.Interval = DefaultOrphanInterval
	}
	if c.DetachTimeout <= 0 {
		c.DetachTimeout = 2 * time.Minute
	}
	return c
}

// OrphanVMs is what the orphan reconciler needs of the host side: the VMs in
// the informers, what each holds, and the hotplug queue's detach that never
// undoes an attach in progress.
type OrphanVMs interface {
	Ready() bool
	VMs() []string
	View(vm string) hotplug.VMView
	DetachUnwantedBefore(ctx context.Context, vm, volume string, deadline time.Time) error
}

// Orphans removes orphaned hot-plugs: volumes of this guest cluster that one
// of its VMs holds (VM spec, a queued request or the VMI) while no guest
// VolumeAttachment asks for them there. They are left behind by a forced
// detach, a VolumeAttachment or guest Node deleted by hand, a publish that
// completed after its caller gave up, or a crash between a write and its
// answer, and they keep the volume from every other node. It runs only in a
// term of the guest node monitor's election (Monitor.lead), and removes a
// hot-plug only when all of these hold: the VM is this cluster's (one of its
// guest Nodes runs on it, NodesOfVM) and the volume is (a guest PV of this
// driver names it, OwnedVolumes); the replica has seen it unasked for
// through Grace within its term; a fresh list of VolumeAttachments and PVs
// from the guest API server agrees; no guest Node may still have it mounted
// (the detach guard's rule, without its timeout); the Lease still names
// this replica; and the queue has no attach of it to that VM in progress.
type Orphans struct {
	cfg     OrphanConfig
	client  kubernetes.Interface
	nodes   *Nodes
	vms     OrphanVMs
	events  EventSink
	now     func() time.Time
	removed prometheus.Counter
	seen    prometheus.Gauge
}

// NewOrphans builds the reconciler; a Monitor runs it (SetOrphans). events
// and reg may be nil.
func NewOrphans(cfg OrphanConfig, client kubernetes.Interface, nodes *Nodes, vms OrphanVMs, events EventSink, reg prometheus.Registerer) (*Orphans, error) {
	o := &Orphans{cfg: cfg.withDefaults(), client: client, nodes: nodes, vms: vms, events: events, now: time.Now,
		removed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "harvester_csi_hotplug_orphans_removed_total",
			Help: "Orphaned hot-plugs (a volume of this guest cluster in one of its VMs that no guest VolumeAttachment asks for) removed through the queue.",
		}),
		seen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "harvester_csi_hotplug_orphans",
			Help: "Orphaned hot-plugs the elected replica sees now (waiting for the grace period, or for the guest to unmount them).",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{o.removed, o.seen} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return o, nil
}

// orphanKey is one hot-plug: a volume on a VM.
type orphanKey struct{ vm, volume string }

// orphanSeen is what a term knows of one orphan: since when it has seen it,
// and whether it said that a guest Node still has it mounted (once: the
// reconciler looks again every Interval).
type orphanSeen struct {
	since       time.Time
	mountedSaid bool
}

// run looks at every VM each Interval until ctx (the term's) ends. confirm
// reads the Lease and returns until when a write may leave this process.
// What it has seen is the term's own: a new term counts the grace again.
func (o *Orphans) run(ctx context.Context, confirm func(context.Context) (time.Time, error)) {
	logger := klog.FromContext(ctx).WithName("orphans")
	ctx = klog.NewContext(ctx, logger)
	first := map[orphanKey]*orphanSeen{}
	defer o.seen.Set(0)
	for {
		if err := o.sweep(ctx, first, confirm); err != nil && ctx.Err() == nil {
			logger.Error(err, "orphaned hot-plugs: will look again", "in", o.cfg.Interval)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(o.cfg.Interval):
		}
	}
}

// sweep finds the orphans in the caches, and removes those seen through the
// grace period once the API server agrees.
func (o *Orphans) sweep(ctx context.Context, first map[orphanKey]*orphanSeen, confirm func(context.Context) (time.Time, error)) error {
	if !o.nodes.HasSynced() || !o.vms.Ready() {
		return nil
	}
	held := o.held()
	if len(held) == 0 {
		clear(first)
		o.seen.Set(0)
		return nil
	}
	// The shared PV cache says which candidates to count: only a
	// candidate's removal needs a quorum read (remove).
	owned, err := o.nodes.cachedOwned()
	if err != nil {
		return err
	}
	vas := o.nodes.cachedAttachments()
	asked := o.asked(vas, owned)
	now := o.now()
	var due []orphanKey
	for k := range first {
		if !held[k] || o.wanted(k, asked, vas) || !owned.Has(k.volume) {
			delete(first, k)
		}
	}
	for k := range held {
		if o.wanted(k, asked, vas) || !owned.Has(k.volume) {
			continue
		}
		if _, ok := first[k]; !ok {
			first[k] = &orphanSeen{since: now}
			klog.FromContext(ctx).Info("orphaned hot-plug: no guest VolumeAttachment asks for the volume on this VM; removed after the grace period unless one does",
				"volume", k.volume, "vm", k.vm, "grace", o.cfg.Grace)
		}
		if now.Sub(first[k].since) >= o.cfg.Grace {
			due = append(due, k)
		}
	}
	o.seen.Set(float64(len(first)))
	slices.SortFunc(due, func(a, b orphanKey) int { return strings.Compare(a.vm+"/"+a.volume, b.vm+"/"+b.volume) })
	var errs []error
	for _, k := range due {
		gone, err := o.remove(ctx, k, first[k], confirm)
		if err != nil {
			errs = append(errs, err)
		}
		if gone {
			delete(first, k)
		}
		if ctx.Err() != nil {
			break
		}
	}
	o.seen.Set(float64(len(first)))
	return errors.Join(errs...)
}

// held lists the hot-plugs of the VMs of this guest cluster, from the
// caches. A VM no guest Node of this cluster runs on is not looked at: it
// may be another guest cluster's in the same namespace.
func (o *Orphans) held() map[orphanKey]bool {
	out := map[orphanKey]bool{}
	for _, vm := range o.vms.VMs() {
		view := o.vms.View(vm)
		if len(view.Volumes) == 0 || len(o.nodes.NodesOfVM(vm)) == 0 {
			continue
		}
		for _, vol := range view.Volumes {
			out[orphanKey{vm, vol}] = true
		}
	}
	return out
}

// asked lists the hot-plugs that a VolumeAttachment of this driver asks for,
// being deleted or not (a detach under way is the attacher's to finish): its
// volume on the VM the attacher recorded, or on the VM of its Node.
func (o *Orphans) asked(vas []*storagev1.VolumeAttachment, owned Owned) map[orphanKey]bool {
	out := map[orphanKey]bool{}
	for _, va := range vas {
		if va.Spec.Attacher != o.nodes.driver {
			continue
		}
		vol := owned.handleOf(va)
		if vol == "" {
			continue
		}
		if id := va.Annotations[AttachedNodeIDAnnotation]; id != "" {
			out[orphanKey{id, vol}] = true
		}
		out[orphanKey{o.nodes.VMOfNode(va.Spec.NodeName), vol}] = true
		if id := o.nodes.knownVM(va.Spec.NodeName); id != "" {
			out[orphanKey{id, vol}] = true
		}
	}
	return out
}

// wanted reports whether a VolumeAttachment asks for the hot-plug: by the
// VM it was recorded on or its Node's VM (asked), or by name on a Node of
// the VM: the attach/detach controller names a VolumeAttachment after the
// volume handle, the driver and the Node, and a Node may be the VM's by its
// providerID alone while its VolumeAttachment lacks the attacher's record.
func (o *Orphans) wanted(k orphanKey, asked map[orphanKey]bool, vas []*storagev1.VolumeAttachment) bool {
	if asked[k] {
		return true
	}
	for _, n := range o.nodes.NodesOfVM(k.vm) {
		name := AttachmentName(k.volume, o.nodes.driver, n.Name)
		if slices.ContainsFunc(vas, func(va *storagev1.VolumeAttachment) bool {
			return va.Name == name && va.Spec.Attacher == o.nodes.driver
		}) {
			return true
		}
	}
	return false
}

// remove removes one orphan after checking again against the API server.
// gone says it is no orphan to count any more (removed, or asked for after
// all); false with a nil error: it waits (the guest may have it mounted).
func (o *Orphans) remove(ctx context.Context, k orphanKey, seen *orphanSeen, confirm func(context.Context) (time.Time, error)) (gone bool, err error) {
	logger := klog.FromContext(ctx).WithValues("volume", k.volume, "vm", k.vm)
	ctx = klog.NewContext(ctx, logger)
	// A quorum read, not the cache: the removal is what cannot be undone,
	// and a cache that lags may still show a PV deleted a moment ago, or
	// miss a VolumeAttachment created a moment ago.
	pvs, err := o.client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, fmt.Errorf("volume %s on VM %s: list guest PVs: %w", k.volume, k.vm, err)
	}
	owned := OwnedVolumes(o.nodes.driver, pvs.Items)
	if !owned.Has(k.volume) {
		logger.Info("orphaned hot-plug: no guest PV of this driver names the volume any more: left alone")
		return true, nil
	}
	list, err := o.client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, fmt.Errorf("volume %s on VM %s: list guest VolumeAttachments: %w", k.volume, k.vm, err)
	}
	vas := make([]*storagev1.VolumeAttachment, len(list.Items))
	for i := range list.Items {
		vas[i] = &list.Items[i]
	}
	if o.wanted(k, o.asked(vas, owned), vas) {
		logger.V(2).Info("orphaned hot-plug: a VolumeAttachment asks for it after all")
		return true, nil
	}
	own := o.nodes.NodesOfVM(k.vm)
	if len(own) == 0 {
		return true, nil
	}
	if users := o.nodes.users(ctx, k.vm, k.volume, own); len(users) > 0 {
		names := make([]string, len(users))
		for i, n := range users {
			names[i] = n.Name
		}
		if !seen.mountedSaid {
			seen.mountedSaid = true
			logger.Info("orphaned hot-plug: a guest node may still have the volume mounted: not removing it until it lets go", "guestNodes", names)
		} else {
			logger.V(4).Info("orphaned hot-plug still mounted", "guestNodes", names)
		}
		return false, nil
	}
	until, err := confirm(ctx)
	if err != nil {
		return false, err
	}
	dctx, cancel := context.WithTimeout(ctx, o.cfg.DetachTimeout)
	defer cancel()
	switch err := o.vms.DetachUnwantedBefore(dctx, k.vm, k.volume, until); {
	case errors.Is(err, hotplug.ErrWanted):
		logger.Info("orphaned hot-plug: the driver is attaching it to this VM right now: left alone")
		return true, nil
	case err != nil:
		return false, fmt.Errorf("remove orphaned volume %s from VM %s: %w", k.volume, k.vm, err)
	}
	o.removed.Inc()
	logger.Info("orphaned hot-plug removed from the VM", "grace", o.cfg.Grace)
	if o.events != nil {
		msg := fmt.Sprintf("volume %s was hot-plugged into VM %s of this node while no VolumeAttachment asked for it there for %s: removed from the VM", k.volume, k.vm, o.cfg.Grace)
		for _, n := range own {
			o.events.NodeEvent(ctx, n, corev1.EventTypeNormal, "OrphanedVolumeRemoved", msg)
		}
	}
	return true, nil
}

// Owned is which host PVCs are this guest cluster's: those a guest PV of
// this driver names as its volume handle.
type Owned struct {
	// handles maps a volume handle to the name of its guest PV, byPV the
	// other way.
	handles, byPV map[string]string
}

// OwnedVolumes reads the guest PVs of driver. A host PVC is this guest
// cluster's exactly when one of them names it: upstream's volumes carry no
// mark of their own on the host, but every one of them has its guest PV, and
// nothing is published without one.
func OwnedVolumes(driver string, pvs []corev1.PersistentVolume) Owned {
	o := newOwned()
	for i := range pvs {
		o.add(driver, &pvs[i])
	}
	return o
}

func newOwned() Owned { return Owned{handles: map[string]string{}, byPV: map[string]string{}} }

// add counts the PV when it is one of driver's.
func (o Owned) add(driver string, pv *corev1.PersistentVolume) {
	if csi := pv.Spec.CSI; csi != nil && csi.Driver == driver && csi.VolumeHandle != "" {
		o.handles[csi.VolumeHandle] = pv.Name
		o.byPV[pv.Name] = csi.VolumeHandle
	}
}

// Has reports whether the host PVC is this guest cluster's.
func (o Owned) Has(volume string) bool { return o.handles[volume] != "" }

// handleOf is the volume a VolumeAttachment attaches ("" when it names no
// PV of this driver).
func (o Owned) handleOf(va *storagev1.VolumeAttachment) string {
	switch src := va.Spec.Source; {
	case src.PersistentVolumeName != nil:
		return o.byPV[*src.PersistentVolumeName]
	case src.InlineVolumeSpec != nil && src.InlineVolumeSpec.CSI != nil:
		return src.InlineVolumeSpec.CSI.VolumeHandle
	}
	return ""
}

// cachedAttachments lists the VolumeAttachments in the cache.
func (n *Nodes) cachedAttachments() []*storagev1.VolumeAttachment {
	objs := n.vas.GetStore().List()
	out := make([]*storagev1.VolumeAttachment, 0, len(objs))
	for _, obj := range objs {
		if va, ok := obj.(*storagev1.VolumeAttachment); ok {
			out = append(out, va)
		}
	}
	return out
}
