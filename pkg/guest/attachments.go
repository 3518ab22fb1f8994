package guest

import (
	"context"
	"crypto/sha256"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// AttachmentEvents writes Events on the guest VolumeAttachment of a volume
// and VM: what a publish or unpublish waits for, or why it was refused, where
// `kubectl describe volumeattachment` shows it beside the attacher's error.
// The recorder aggregates repeats (the attacher retries a call every few
// seconds).
type AttachmentEvents struct {
	client   kubernetes.Interface
	nodes    *Nodes
	driver   string
	recorder *Recorder
}

// NewAttachmentEvents records through recorder.
func NewAttachmentEvents(client kubernetes.Interface, nodes *Nodes, driver string, recorder *Recorder) *AttachmentEvents {
	return &AttachmentEvents{client: client, nodes: nodes, driver: driver, recorder: recorder}
}

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
		a.recorder.recorder.Event(va, eventType, reason, message)
	}
}

// AttachmentName is the name Kubernetes gives the VolumeAttachment of a CSI
// volume handle on a node (the attach/detach controller's csi attacher
// hashes handle, driver and node name).
func AttachmentName(volumeHandle, driver, node string) string {
	return fmt.Sprintf("csi-%x", sha256.Sum256([]byte(volumeHandle+driver+node)))
}
