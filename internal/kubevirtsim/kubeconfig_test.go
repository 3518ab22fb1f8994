package kubevirtsim

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// A process given the kubeconfig must act as the admin, not as
// system:anonymous (client-go drops a token for an http server), and reach the
// simulator through its front proxy.
func TestWriteKubeconfigKeepsTheToken(t *testing.T) {
	s, ns := testSim(t, Options{})
	ctx := testCtx(t, 60*time.Second)
	frontCtx, stopFront := context.WithCancel(ctx)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := s.WriteKubeconfig(frontCtx, path, ns); err != nil {
		t.Fatal(err)
	}
	// Load it the way a driver binary does.
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, &clientcmd.ConfigOverrides{})
	cfg, err := loader.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	if gotNS, _, err := loader.Namespace(); err != nil || gotNS != ns {
		t.Fatalf("kubeconfig namespace = %q, %v; want %q", gotNS, err, ns)
	}
	if cfg.BearerToken == "" {
		t.Fatalf("the loaded config has no token (server %s): the process would be anonymous", cfg.Host)
	}
	kube := kubernetes.NewForConfigOrDie(cfg)
	review, err := kube.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := review.Status.UserInfo.Username; got != "admin" {
		t.Fatalf("acting as %q, want the admin", got)
	}
	before := s.Stats().Requests[RequestKey{Verb: "create", Group: "authentication.k8s.io", Resource: "selfsubjectreviews"}]
	if before == 0 {
		t.Fatalf("the request did not pass through the front proxy (stats: %v)", s.Stats().Requests)
	}

	stopFront()
	short, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	testwait.Until(short, t, "the TLS front to stop answering once its context ended", func() (bool, string) {
		// The parent context: an error must come from the front, not from
		// the wait's own deadline.
		_, err := kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		return err != nil, "it still answers"
	})
}
