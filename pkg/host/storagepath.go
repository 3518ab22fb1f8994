package host

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/klog/v2"
)

// Kinds of StorageIssue: what on the host storage path under a hot-plug keeps
// a volume from its VM.
const (
	// LonghornNotReady: Longhorn refuses the volume to workloads (faulted,
	// replicas that cannot be scheduled).
	LonghornNotReady = "longhorn-not-ready"
	// LonghornElsewhere: the volume is attached (or being attached) on
	// another host node than the one its VM runs on.
	LonghornElsewhere = "longhorn-attached-elsewhere"
	// LonghornMigrating: Longhorn is moving the volume between host nodes.
	LonghornMigrating = "longhorn-migrating"
	// AttachmentPodUnschedulable: the VM's attachment pod cannot be
	// scheduled to the VM's host node.
	AttachmentPodUnschedulable = "attachment-pod-unschedulable"
	// AttachmentPodVolumeWait: the attachment pod is on its node, but the
	// host has not attached or mounted its volumes.
	AttachmentPodVolumeWait = "attachment-pod-volume-wait"
	// AttachmentPodRefused: KubeVirt could not create the attachment pod
	// (e.g. a ResourceQuota refuses it).
	AttachmentPodRefused = "attachment-pod-refused"
)

// StorageIssue is one thing on the host storage path that keeps a volume
// from a VM.
type StorageIssue struct {
	Kind string
	// VM is the VM concerned, if the issue is about one.
	VM      string
	Message string
}

// StorageQuery names a volume's host claim and the VMs to look at.
type StorageQuery struct {
	Claim *corev1.PersistentVolumeClaim
	// Holders are the VMs whose spec holds the volume: the host node each
	// runs on is where the volume must be attached.
	Holders []string
	// Waiting are the holders whose hotplug of the volume is not done:
	// their attachment pods are looked at.
	Waiting []string
}

// StorageReader reads the host storage path under hot-plugged volumes: the
// claim's Longhorn volume and tickets, and the VMs' attachment pods and
// their Events. Every read is optional: the host identity may lack its rule
// (docs/host-rbac.md, `hack/host-rbac.sh --storage-read`), and a host may
// run no Longhorn; such a read is skipped, and a refused one is logged once
// (at verbosity 2) rather than reported to the caller.
type StorageReader struct {
	c *Client

	mu sync.Mutex
	// refused holds the reads the host refused, so each is logged once.
	refused map[string]bool
}

// NewStorageReader returns a StorageReader on c.
func NewStorageReader(c *Client) *StorageReader {
	return &StorageReader{c: c, refused: map[string]bool{}}
}

// Reads the StorageReader makes, as docs/host-rbac.md names their rules.
const (
	readPV       = "get persistentvolumes"
	readLonghorn = "get volumes.longhorn.io in " + LonghornNamespace
	readTickets  = "get volumeattachments.longhorn.io in " + LonghornNamespace
	readVMI      = "get virtualmachineinstances"
	readPods     = "list pods"
	readEvents   = "list events"
)

// Issues reads the storage path under q's claim and says what keeps the
// volume from its VMs. The error is a read that failed for another reason
// than a refusal or an absent object; what could be read is still judged.
func (r *StorageReader) Issues(ctx context.Context, q StorageQuery) ([]StorageIssue, error) {
	if q.Claim != nil {
		ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volume", q.Claim.Name, "vms", q.Holders))
	}
	lh, lhErr := r.longhornIssues(ctx, q)
	pods, podErr := r.podIssues(ctx, q)
	return append(lh, pods...), errors.Join(lhErr, podErr)
}

// Refused lists the reads the host refused so far, sorted.
func (r *StorageReader) Refused() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.refused))
}

// skip reports whether a failed read is to be left out: the object or its
// kind is absent on this host, or the identity may not make the read (logged
// once per read).
func (r *StorageReader) skip(ctx context.Context, read string, err error) bool {
	switch {
	case err == nil:
		return false
	case apierrors.IsNotFound(err):
		return true
	case apierrors.IsForbidden(err):
		r.mu.Lock()
		first := !r.refused[read]
		r.refused[read] = true
		r.mu.Unlock()
		if first {
			klog.FromContext(ctx).V(2).Info("Host storage read not allowed, skipped: docs/host-rbac.md says which rule adds it",
				"read", read, "namespace", r.c.Namespace, "err", err)
		}
		return true
	}
	return false
}

// longhornIssues follows the claim to its PV and Longhorn volume: a PV of
// another CSI driver has none.
func (r *StorageReader) longhornIssues(ctx context.Context, q StorageQuery) ([]StorageIssue, error) {
	if q.Claim == nil || q.Claim.Spec.VolumeName == "" {
		return nil, nil
	}
	pv, err := r.c.Kube.CoreV1().PersistentVolumes().Get(ctx, q.Claim.Spec.VolumeName, metav1.GetOptions{})
	if r.skip(ctx, readPV, err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read host PV %s of claim %s: %w", q.Claim.Spec.VolumeName, q.Claim.Name, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != LonghornProvisioner {
		return nil, nil
	}
	vol, err := r.c.GetLonghornVolume(ctx, pv.Spec.CSI.VolumeHandle)
	if r.skip(ctx, readLonghorn, err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	nodes, err := r.vmNodes(ctx, q.Holders)
	issues := JudgeLonghorn(vol, nodes, nil)
	if len(issues) == 0 {
		return nil, err
	}
	// Only a volume with something to explain costs the tickets' read.
	tickets, terr := r.c.GetLonghornTickets(ctx, vol.Name)
	if r.skip(ctx, readTickets, terr) {
		return issues, err
	}
	if terr != nil {
		return issues, errors.Join(err, terr)
	}
	return JudgeLonghorn(vol, nodes, tickets), err
}

// vmNodes maps each VM to the host node its VMI runs on ("" when unknown).
func (r *StorageReader) vmNodes(ctx context.Context, vms []string) (map[string]string, error) {
	out := map[string]string{}
	var errs []error
	for _, vm := range vms {
		vmi, err := r.c.KubeVirt.KubevirtV1().VirtualMachineInstances(r.c.Namespace).Get(ctx, vm, metav1.GetOptions{})
		switch {
		case r.skip(ctx, readVMI, err):
			out[vm] = ""
		case err != nil:
			errs = append(errs, fmt.Errorf("read the VMI of VM %s: %w", vm, err))
		default:
			out[vm] = vmi.Status.NodeName
		}
	}
	return out, errors.Join(errs...)
}

// JudgeLonghorn says what in a Longhorn volume's state keeps it from the
// VMs (vmNodes: the host node each holder runs on); tickets, when read,
// name who holds the volume.
func JudgeLonghorn(vol *LonghornVolume, vmNodes map[string]string, tickets []LonghornTicket) []StorageIssue {
	if why := vol.NotReady(); why != "" {
		return []StorageIssue{{Kind: LonghornNotReady, Message: fmt.Sprintf(
			"Longhorn volume %s is not ready for workloads: %s; Longhorn refuses to attach it (Aborted) until it is%s",
			vol.Name, why, ticketList(tickets))}}
	}
	st := vol.Status
	if vol.Migrating() {
		to := cmp.Or(vol.Spec.MigrationNodeID, st.CurrentMigrationNodeID)
		engine := "starting"
		if st.CurrentMigrationNodeID != "" && st.CurrentMigrationNodeID == vol.Spec.MigrationNodeID {
			engine = "ready, waiting for the ticket on " + st.CurrentNodeID + " to go"
		}
		return []StorageIssue{{Kind: LonghornMigrating, Message: fmt.Sprintf(
			"Longhorn volume %s is migrating from host node %s to %s (migration engine %s)%s", vol.Name, st.CurrentNodeID, to, engine, ticketList(tickets))}}
	}
	// A non-migratable RWX volume is served by a share manager, on a node
	// of Longhorn's choosing.
	if vol.Spec.AccessMode == "rwx" && !vol.Spec.Migratable {
		return nil
	}
	var out []StorageIssue
	for _, vm := range slices.Sorted(maps.Keys(vmNodes)) {
		node := vmNodes[vm]
		var where string
		switch {
		case node == "":
			continue
		case st.CurrentNodeID != "" && st.CurrentNodeID != node:
			where = "is still attached on host node " + st.CurrentNodeID
		case st.CurrentNodeID == "" && vol.Spec.NodeID != "" && vol.Spec.NodeID != node:
			where = "is being attached on host node " + vol.Spec.NodeID
		default:
			continue
		}
		out = append(out, StorageIssue{Kind: LonghornElsewhere, VM: vm, Message: fmt.Sprintf(
			"Longhorn volume %s %s (state %s), but VM %s runs on host node %s: Longhorn attaches it there only once it has let go%s",
			vol.Name, where, st.State, vm, node, ticketList(tickets))})
	}
	return out
}

func ticketList(tickets []LonghornTicket) string {
	if len(tickets) == 0 {
		return ""
	}
	parts := make([]string, 0, len(tickets))
	for _, t := range tickets {
		s := fmt.Sprintf("%s on %s", t.ID, t.NodeID)
		switch {
		case t.Satisfied:
			s += " satisfied"
		case t.Message != "":
			s += " waiting: " + t.Message
		default:
			s += " waiting"
		}
		parts = append(parts, s)
	}
	return "; attachment tickets: " + strings.Join(parts, ", ")
}

// KubeVirt labels its attachment pods kubevirt.io=hotplug-disk, controlled
// by the VM's virt-launcher pod (labelled kubevirt.io=virt-launcher and
// controlled by the VMI); each has a PVC volume per hot-plugged claim
// (kubevirt v1.7.0 pkg/virt-controller/services/template.go,
// RenderHotplugAttachmentPodTemplate).
const hotplugPodSelector = "kubevirt.io in (hotplug-disk,virt-launcher)"

// podIssues looks at the attachment pods of the VMs still waiting for the
// volume. KubeVirt makes no new attachment pod while one of the VM's is
// Pending (kubevirt v1.7.0 pkg/virt-controller/watch/vmi/volume-hotplug.go),
// so any Pending attachment pod of the VM holds the volume back.
func (r *StorageReader) podIssues(ctx context.Context, q StorageQuery) ([]StorageIssue, error) {
	if q.Claim == nil || len(q.Waiting) == 0 {
		return nil, nil
	}
	list, err := r.c.Kube.CoreV1().Pods(r.c.Namespace).List(ctx, metav1.ListOptions{LabelSelector: hotplugPodSelector})
	if r.skip(ctx, readPods, err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list the attachment pods of namespace %s: %w", r.c.Namespace, err)
	}
	var out []StorageIssue
	var errs []error
	for _, vm := range q.Waiting {
		pods := AttachmentPodsOf(vm, list.Items)
		var pending []*corev1.Pod
		has := false
		for _, p := range pods {
			has = has || slices.Contains(PodClaims(p), q.Claim.Name)
			if p.Status.Phase == corev1.PodPending {
				pending = append(pending, p)
			}
		}
		for _, p := range pending {
			events, err := r.events(ctx, "Pod", p.Name)
			errs = append(errs, err)
			if i := JudgeAttachmentPod(vm, p, events); i != nil {
				out = append(out, *i)
			}
		}
		if len(pending) == 0 && !has {
			events, err := r.events(ctx, "VirtualMachineInstance", vm)
			errs = append(errs, err)
			if i := JudgeAttachmentRefused(vm, events); i != nil {
				out = append(out, *i)
			}
		}
	}
	return out, errors.Join(errs...)
}

// events lists the Events of one object of the namespace; a refused read
// gives none.
func (r *StorageReader) events(ctx context.Context, kind, name string) ([]corev1.Event, error) {
	sel := fields.Set{"involvedObject.kind": kind, "involvedObject.name": name}.AsSelector().String()
	list, err := r.c.Kube.CoreV1().Events(r.c.Namespace).List(ctx, metav1.ListOptions{FieldSelector: sel})
	if r.skip(ctx, readEvents, err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list the Events of %s %s: %w", kind, name, err)
	}
	var out []corev1.Event
	for _, e := range list.Items {
		if e.InvolvedObject.Kind == kind && e.InvolvedObject.Name == name {
			out = append(out, e)
		}
	}
	return out, nil
}

// AttachmentPodsOf picks, from a namespace's attachment and virt-launcher
// pods, the attachment pods of a VM that are not being deleted: controlled
// by a virt-launcher pod that the VM's VMI controls (or by the VMI itself,
// as the test kit's simulator makes them).
func AttachmentPodsOf(vm string, pods []corev1.Pod) []*corev1.Pod {
	launchers := map[string]bool{}
	for i := range pods {
		ref := metav1.GetControllerOf(&pods[i])
		if pods[i].Labels["kubevirt.io"] == "virt-launcher" && ref != nil && ref.Kind == "VirtualMachineInstance" && ref.Name == vm {
			launchers[pods[i].Name] = true
		}
	}
	var out []*corev1.Pod
	for i := range pods {
		p := &pods[i]
		ref := metav1.GetControllerOf(p)
		if p.Labels["kubevirt.io"] != "hotplug-disk" || p.DeletionTimestamp != nil || ref == nil {
			continue
		}
		if (ref.Kind == "Pod" && launchers[ref.Name]) || (ref.Kind == "VirtualMachineInstance" && ref.Name == vm) {
			out = append(out, p)
		}
	}
	return out
}

// PodClaims lists the claims a pod mounts.
func PodClaims(p *corev1.Pod) []string {
	var out []string
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			out = append(out, v.PersistentVolumeClaim.ClaimName)
		}
	}
	slices.Sort(out)
	return out
}

// Reasons of the Events that say a scheduled pod's volumes are not there:
// the attach/detach controller's and kubelet's (kubernetes v1.33
// pkg/kubelet/events/event.go, FailedAttachVolume and FailedMountVolume).
var volumeWaitReasons = []string{"FailedAttachVolume", "FailedMount"}

// JudgeAttachmentPod says why a Pending attachment pod of vm does not run,
// or nil while nothing says it cannot (it is starting).
func JudgeAttachmentPod(vm string, p *corev1.Pod, events []corev1.Event) *StorageIssue {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
			return &StorageIssue{Kind: AttachmentPodUnschedulable, VM: vm, Message: fmt.Sprintf(
				"attachment pod %s of VM %s is Pending, not scheduled: %s (it must run on the VM's host node with the virt-launcher's tolerations: a cordoned host node, a taint or the node's capacity keeps it there, and every hotplug of the VM waits)",
				p.Name, vm, cmp.Or(c.Message, c.Reason))}
		}
	}
	if p.Spec.NodeName == "" {
		return nil
	}
	if e := latest(events, func(e *corev1.Event) bool {
		return e.Type == corev1.EventTypeWarning && slices.Contains(volumeWaitReasons, e.Reason)
	}); e != nil {
		return &StorageIssue{Kind: AttachmentPodVolumeWait, VM: vm, Message: fmt.Sprintf(
			"attachment pod %s of VM %s is Pending on host node %s: %s: %s", p.Name, vm, p.Spec.NodeName, e.Reason, e.Message)}
	}
	return nil
}

// attachmentPodRefusal is how KubeVirt's VMI controller says it could not
// create an attachment pod, an Event FailedCreate on the VMI (kubevirt
// v1.7.0 pkg/virt-controller/watch/vmi/volume-hotplug.go:192).
const attachmentPodRefusal = "Error creating attachment pod"

// JudgeAttachmentRefused reports the VMI's last Event saying KubeVirt could
// not create the attachment pod, or nil.
func JudgeAttachmentRefused(vm string, events []corev1.Event) *StorageIssue {
	e := latest(events, func(e *corev1.Event) bool {
		return e.Reason == "FailedCreate" && strings.HasPrefix(e.Message, attachmentPodRefusal)
	})
	if e == nil {
		return nil
	}
	return &StorageIssue{Kind: AttachmentPodRefused, VM: vm, Message: fmt.Sprintf(
		"KubeVirt cannot create the attachment pod of VM %s (%d times, last %s): %s",
		vm, max(e.Count, 1), eventTime(e).UTC().Format(time.RFC3339), e.Message)}
}

func latest(events []corev1.Event, match func(*corev1.Event) bool) *corev1.Event {
	var out *corev1.Event
	for i := range events {
		e := &events[i]
		if match(e) && (out == nil || eventTime(e).After(eventTime(out))) {
			out = e
		}
	}
	return out
}

func eventTime(e *corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}
