package diagnose

import (
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// KubeVirt labels its attachment pods kubevirt.io=hotplug-disk (kubevirt
// v1.7.0 pkg/virt-controller/services/template.go,
// RenderHotplugAttachmentPodTemplate: name hp-volume-*, controlled by the
// VM's virt-launcher pod, one PVC volume per hot-plugged claim) and the
// virt-launcher pods kubevirt.io=virt-launcher (controlled by the VMI).
const (
	kubevirtAppLabel = "kubevirt.io"
	attachmentPodApp = "hotplug-disk"
	launcherPodApp   = "virt-launcher"
)

// judgeHostClaims checks the host PVC behind each guest PV of this driver:
// the PV's volume handle is the host PVC's name. A PV being deleted, or
// released for deletion, no longer needs one.
func (v *view) judgeHostClaims(r *report) {
	if !v.in.GuestRead {
		return
	}
	for _, vol := range sortedKeys(v.pvs) {
		pv := v.pvs[vol]
		if pv.DeletionTimestamp != nil || pv.Status.Phase == corev1.VolumeReleased {
			continue
		}
		f := Finding{Volume: vol}
		switch pvc := v.claims[vol]; {
		case pvc == nil:
			f.Kind, f.Detail = HostClaimMissing, fmt.Sprintf("guest PV %s names host PVC %s/%s, which does not exist", pv.Name, v.in.Namespace, vol)
		case pvc.Status.Phase == corev1.ClaimLost:
			f.Kind, f.Detail = HostClaimLost, fmt.Sprintf("host PVC %s/%s of guest PV %s is Lost: its host PV %q is gone", v.in.Namespace, vol, pv.Name, pvc.Spec.VolumeName)
		case pvc.Status.Phase == corev1.ClaimPending && v.older(pvc.CreationTimestamp):
			f.Kind, f.Detail = HostClaimPending, fmt.Sprintf("host PVC %s/%s of guest PV %s has been Pending for %s (storage class %s)",
				v.in.Namespace, vol, pv.Name, v.age(pvc.CreationTimestamp), storageClass(pvc))
		default:
			continue
		}
		r.add(f)
	}
}

// judgeAttachmentPods reports attachment pods Pending for longer than
// SlowAfter, with the reason their status gives. An attachment pod starts
// within seconds when it can; one that cannot holds every hotplug of its VM.
func (v *view) judgeAttachmentPods(r *report) {
	launchers := map[string]*corev1.Pod{}
	for i := range v.in.HostPods {
		p := &v.in.HostPods[i]
		if p.Labels[kubevirtAppLabel] == launcherPodApp {
			launchers[p.Name] = p
		}
	}
	for i := range v.in.HostPods {
		p := &v.in.HostPods[i]
		if p.Labels[kubevirtAppLabel] != attachmentPodApp || p.Status.Phase != corev1.PodPending || p.DeletionTimestamp != nil || !v.older(p.CreationTimestamp) {
			continue
		}
		claims := podClaims(p)
		f := Finding{Kind: AttachmentPodPending, VM: attachmentPodVM(p, launchers), Detail: fmt.Sprintf("attachment pod %s has been Pending for %s: %s; its claims: %s",
			p.Name, v.age(p.CreationTimestamp), pendingReason(p), strings.Join(claims, ", "))}
		if len(claims) == 1 {
			f.Volume = claims[0]
		}
		r.add(f)
	}
}

// attachmentPodVM follows the pod's controllers up to its VMI, whose name is
// the VM's: KubeVirt's attachment pod is controlled by the virt-launcher pod,
// which the VMI controls.
func attachmentPodVM(p *corev1.Pod, launchers map[string]*corev1.Pod) string {
	for range 2 {
		ref := metav1.GetControllerOf(p)
		switch {
		case ref == nil:
			return ""
		case ref.Kind == "VirtualMachineInstance":
			return ref.Name
		case ref.Kind == "Pod" && launchers[ref.Name] != nil:
			p = launchers[ref.Name]
		default:
			return ""
		}
	}
	return ""
}

func podClaims(p *corev1.Pod) []string {
	var out []string
	for _, vol := range p.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil {
			out = append(out, vol.PersistentVolumeClaim.ClaimName)
		}
	}
	slices.Sort(out)
	return out
}

// pendingReason is why a Pending pod does not run, as its status says: the
// scheduler's verdict, else a waiting container's reason.
func pendingReason(p *corev1.Pod) string {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
			return "not scheduled: " + reasonMessage(c.Reason, c.Message)
		}
	}
	for _, cs := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
		if w := cs.State.Waiting; w != nil {
			return fmt.Sprintf("container %s waiting: %s", cs.Name, reasonMessage(w.Reason, w.Message))
		}
	}
	if p.Spec.NodeName == "" {
		return "not scheduled yet"
	}
	return "on node " + p.Spec.NodeName + ", no reason in its status"
}

// judgeCSINodes reports a guest CSINode whose node ID of this driver names
// no VM of the host namespace: the external-attacher sends that node ID as
// the VM to publish to, so every publish to that Node answers NotFound.
func (v *view) judgeCSINodes(r *report) {
	vms := map[string]bool{}
	for _, vm := range v.in.VMs {
		vms[vm.Name] = true
	}
	for _, cn := range v.in.CSINodes {
		for _, d := range cn.Spec.Drivers {
			if d.Name == v.in.Driver && d.NodeID != "" && !vms[d.NodeID] {
				r.add(Finding{Kind: CSINodeUnknownVM, VM: d.NodeID, Node: cn.Name, Detail: fmt.Sprintf(
					"CSINode %s gives %s the node ID %s, but the host namespace %s has no VM of that name", cn.Name, v.in.Driver, d.NodeID, v.in.Namespace)})
			}
		}
	}
}

// judgeVolumesInUse reports, as information, a volume a guest Node lists in
// status.volumesInUse while the Node's VM does not hold it and no live
// VolumeAttachment of the volume on that Node explains it (an attached one
// is attached-but-lost, an attaching one is an attach under way). Kubelet
// lists a volume there from the moment a pod wants it, before it is mounted,
// and drops it only after unmounting, so the listing alone cannot tell a
// mount left on a disk that is gone from a pod about to ask for an attach.
func (v *view) judgeVolumesInUse(r *report) {
	if !v.in.GuestRead {
		return
	}
	live := map[string]bool{} // volume "^" Node
	for _, a := range v.attachments {
		if !a.deleting() {
			live[a.vol+"^"+a.va.Spec.NodeName] = true
		}
	}
	prefix := "kubernetes.io/csi/" + v.in.Driver + "^"
	for _, n := range v.in.Nodes {
		vm := v.nodes.vm[n.Name]
		if vm == "" {
			continue
		}
		for _, u := range n.Status.VolumesInUse {
			vol, ok := strings.CutPrefix(string(u), prefix)
			if !ok || live[vol+"^"+n.Name] || v.isRWX(vol, v.pvs[vol]) {
				continue
			}
			if h := v.holds[vol][vm]; h != nil && h.held() {
				continue
			}
			r.add(Finding{Kind: InUseNotInVM, Volume: vol, VM: vm, Node: n.Name, Info: true, Detail: fmt.Sprintf(
				"Node %s lists the volume in volumesInUse, but VM %s does not hold it and no VolumeAttachment on the Node asks for it%s",
				n.Name, vm, staleness(&n))})
		}
	}
}

func reasonMessage(reason, message string) string {
	if reason != "" && message != "" {
		return reason + ": " + message
	}
	return reason + message
}

func staleness(n *corev1.Node) string {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			return ""
		}
	}
	return " (the Node is not Ready: its list may be stale)"
}

func (v *view) older(t metav1.Time) bool { return v.in.Now.Sub(t.Time) >= v.in.SlowAfter }

func (v *view) age(t metav1.Time) time.Duration { return v.in.Now.Sub(t.Time).Round(time.Second) }

func storageClass(pvc *corev1.PersistentVolumeClaim) string {
	if pvc.Spec.StorageClassName == nil {
		return "(the default)"
	}
	return *pvc.Spec.StorageClassName
}
