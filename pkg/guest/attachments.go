package guest

import (
	"context"
	"crypto/sha256"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	corev1 "k8s.io/api/core/v1"
)

// AttachmentEvents writes Events on the guest VolumeAttachment of a volume
// and VM: what a publish or unpublish waits for, or why it was refused, where
// `kubectl describe volumeattachment` shows it beside the attacher's error.
// client-go's correlator aggregates repeats (the attacher retries a call
// every few seconds) and rate-limits them per object.
type AttachmentEvents struct {
	client      kubernetes.Interface
	nodes       *Nodes
	driver      string
	broadcaster record.EventBroadcaster
	recorder    record.EventRecorder
}

// NewAttachmentEvents starts recording; Stop ends it.
func NewAttachmentEvents(client kubernetes.Interface, nodes *Nodes, driver string) *AttachmentEvents {
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return &AttachmentEvents{client: client, nodes: nodes, driver: driver, broadcaster: b,
		recorder: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: driver})}
}

// Stop flushes and stops the recorder.
func (a *AttachmentEvents) Stop() { a.broadcaster.Shutdown() }

// Record writes an Event on the VolumeAttachment of volume on each guest
// Node of vm, if it exists. Failures are logged: the Event explains an
// answer already given.
func (a *AttachmentEvents) Record(ctx context.Context, volume, vm, eventType, reason, message string) {
	for _, node := range a.nodes.NodesOfVM(vm) {
		name := AttachmentName(volume, a.driver, node.Name)
		va, err := a.client.StorageV1().VolumeAttachments().Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			continue
		case err != nil:
			klog.FromContext(ctx).V(2).Info("cannot read the VolumeAttachment for an Event", "volume", volume, "vm", vm, "volumeAttachment", name, "err", err)
			continue
		}
		a.recorder.Event(va, eventType, reason, message)
	}
}

// AttachmentName is the name Kubernetes gives the VolumeAttachment of a CSI
// volume handle on a node (the attach/detach controller's csi attacher
// hashes handle, driver and node name).
func AttachmentName(volumeHandle, driver, node string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(volumeHandle+driver+node)))
}
