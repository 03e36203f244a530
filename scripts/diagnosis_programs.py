"""The healthy training programs of ``scripts/diagnosis_benchmark.py``, and what its sick programs build on.

Each program is the loop shape of a pytorch/examples program or a small real model at a size a CPU trains in
seconds, on data made here (random inputs labelled by a fixed random teacher, a Markov-chain corpus, sines).
A :class:`Program` owns its model, optimizer and data; :meth:`Program.step` runs one training step and returns
its loss. A sick program also checks, with hooks of its own (not actviz's), that its pathology really happened:
:meth:`Program.happened` returns what it saw, or ``None``.

Example:
    >>> program = HEALTHY["regression"]()
    >>> losses = [program.step(step) for step in range(3)]
    >>> all(loss >= 0 for loss in losses)
    True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HEALTHY", "Program"]


def teacher_labels(inputs: torch.Tensor, classes: int, seed: int = 1) -> torch.Tensor:
    """Labels from a fixed random two-layer teacher: learnable, nothing downloaded."""
    generator = torch.Generator().manual_seed(seed)
    flat = inputs.flatten(1)
    hidden = torch.tanh(flat @ torch.randn(flat.shape[1], 32, generator=generator) / math.sqrt(flat.shape[1]))
    return (hidden @ torch.randn(32, classes, generator=generator)).argmax(1)


def markov_corpus(vocab: int, length: int, seed: int = 2) -> torch.Tensor:
    """A token stream from a random Markov chain whose rows favour three successors."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator)
    logits.scatter_(1, torch.randint(0, vocab, (vocab, 3), generator=generator), 4.0)
    probabilities = logits.softmax(1)
    tokens = [0]
    for _ in range(length - 1):
        tokens.append(int(torch.multinomial(probabilities[tokens[-1]], 1, generator=generator)))
    return torch.tensor(tokens)


class Program:
    """One training loop: ``model`` is what actviz watches (``watched`` lists more); ``step`` trains one step.

    Sick programs set ``onset`` (the step the pathology starts), ``cause``, ``rules`` (the alerts that name it),
    ``layers`` (the layers such an alert may name; ``None``: any) and ``watch`` (options of ``actviz.watch``).
    """

    onset: int | None = None
    cause = ""
    rules: frozenset[str] = frozenset()
    layers: frozenset[str] | None = None
    watch: dict = {}
    model: nn.Module

    @property
    def watched(self) -> dict[str, nn.Module]:
        """The models to watch, by run folder name."""
        return {"model": self.model}

    def step(self, step: int) -> float:
        raise NotImplementedError

    def happened(self) -> str | None:
        """What the program's own hooks saw of its pathology, or ``None`` (a healthy program: ``None``)."""
        return None


class Classifier(Program):
    """Inputs labelled by a teacher, a batch at a time, one optimizer step each (the mnist example's loop)."""

    def __init__(self, model: nn.Module, inputs: torch.Tensor, classes: int, optimizer, batch: int = 32,
                 log_softmax: bool = False) -> None:
        self.model, self.inputs, self.labels = model, inputs, teacher_labels(inputs, classes)
        self.optimizer, self.batch, self.log_softmax = optimizer, batch, log_softmax
        self.generator = torch.Generator().manual_seed(3)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.inputs), (self.batch,), generator=self.generator)
        return self.inputs[index], self.labels[index]

    def step(self, step: int) -> float:
        inputs, labels = self.batch_at(step)
        output = self.model(inputs)
        loss = F.nll_loss(output, labels) if self.log_softmax else F.cross_entropy(output, labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()


class MnistNet(nn.Module):
    """pytorch/examples mnist's Net at 14 x 14 pixels, 8 and 16 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(400, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout1(x).flatten(1)
        return F.log_softmax(self.fc2(self.dropout2(F.relu(self.fc1(x)))), dim=1)


def mnist_cnn(lr: float = 1.0) -> Classifier:
    """The mnist example: Adadelta at lr 1.0, log-softmax and NLL loss."""
    torch.manual_seed(0)
    model = MnistNet()
    images = F.avg_pool2d(torch.randn(1024, 1, 28, 28), 2) * 2
    return Classifier(model, images, 10, torch.optim.Adadelta(model.parameters(), lr=lr), log_softmax=True)


class VAE(Program):
    """pytorch/examples vae at 64 inputs, 32 hidden, 8 latent: BCE + KL, Adam at 1e-3."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = VAENet()
        prototypes = (torch.rand(8, 64) > 0.5).float()
        self.data = (prototypes[torch.randint(0, 8, (1024,))] + 0.2 * torch.rand(1024, 64)).clamp(0, 1)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def step(self, step: int) -> float:
        x = self.data[torch.randint(0, len(self.data), (32,))]
        recon, mu, logvar = self.model(x)
        loss = F.binary_cross_entropy(recon, x, reduction="sum") - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item() / len(x)


class VAENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(64, 32), nn.Linear(32, 8), nn.Linear(32, 8)
        self.fc3, self.fc4 = nn.Linear(8, 32), nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.fc1(x))
        mu, logvar = self.fc21(hidden), self.fc22(hidden)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


class DCGAN(Program):
    """pytorch/examples dcgan at 16 x 16 pixels (nz 16, ngf = ndf = 8): D on real and fake, then G; Adam 2e-4."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        nz, ngf, ndf = 16, 8, 8
        self.nz = nz
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False), nn.Tanh())
        self.discriminator = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())
        for module in [*self.generator.modules(), *self.discriminator.modules()]:  # the example's weights_init
            if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.normal_(module.weight, 1.0, 0.02)
                nn.init.zeros_(module.bias)
        self.model = self.generator
        grid = torch.linspace(-1, 1, 16)
        centres = torch.rand(512, 2, 1, 1) * 1.2 - 0.6
        self.real = torch.tanh(3 * (0.5 - ((grid.view(1, 1, 16) - centres[:, :1]) ** 2
                                            + (grid.view(1, 16, 1) - centres[:, 1:]) ** 2).sqrt() * 2))
        self.opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))

    @property
    def watched(self) -> dict[str, nn.Module]:
        return {"generator": self.generator, "discriminator": self.discriminator}

    def step(self, step: int) -> float:
        real = self.real[torch.randint(0, len(self.real), (32,))]
        ones, zeros = torch.ones(32), torch.zeros(32)
        self.discriminator.zero_grad()
        F.binary_cross_entropy(self.discriminator(real).view(-1), ones).backward()
        fake = self.generator(torch.randn(32, self.nz, 1, 1))
        F.binary_cross_entropy(self.discriminator(fake.detach()).view(-1), zeros).backward()
        self.opt_d.step()
        self.generator.zero_grad()
        loss = F.binary_cross_entropy(self.discriminator(fake).view(-1), ones)
        loss.backward()
        self.opt_g.step()
        return loss.item()


class WordLM(Program):
    """pytorch/examples word_language_model: SGD by hand at lr 20, gradients clipped at 0.25, bptt 16, batch 8."""

    def __init__(self, model: nn.Module, recurrent: bool, clip: float | None = 0.25, lr: float = 20.0) -> None:
        self.model, self.recurrent, self.clip, self.lr = model, recurrent, clip, lr
        corpus = markov_corpus(model.ntoken, 8 * 600)
        self.data = corpus.view(8, -1).t().contiguous()  # batchify: (length, batch)
        self.hidden = model.init_hidden(8) if recurrent else None
        self.position = 0

    def step(self, step: int) -> float:
        if self.position + 17 > len(self.data):
            self.position = 0
        data, target = self.data[self.position:self.position + 16], self.data[self.position + 1:self.position + 17]
        self.position += 16
        self.model.zero_grad()
        if self.recurrent:
            self.hidden = tuple(h.detach() for h in self.hidden)  # repackage_hidden
            output, self.hidden = self.model(data, self.hidden)
        else:
            output = self.model(data)
        loss = F.nll_loss(output.view(-1, self.model.ntoken), target.reshape(-1))
        loss.backward()
        if self.clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        for param in self.model.parameters():
            param.data.add_(param.grad, alpha=-self.lr)
        return loss.item()


class RNNModel(nn.Module):
    """word_language_model's RNNModel (LSTM), 64 tokens, 32 wide, 2 layers."""

    def __init__(self, ntoken: int = 64, width: int = 32) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, width)
        self.rnn = nn.LSTM(width, width, 2, dropout=0.2)
        self.decoder = nn.Linear(width, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def init_hidden(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, batch, 32), torch.zeros(2, batch, 32)

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return F.log_softmax(self.decoder(self.drop(output)), dim=-1), hidden


class TransformerLM(nn.Module):
    """word_language_model's TransformerModel: causal mask, sinusoidal positions, 2 layers, 32 wide."""

    def __init__(self, ntoken: int = 64, width: int = 32) -> None:
        super().__init__()
        self.ntoken, self.width = ntoken, width
        position = torch.arange(64).unsqueeze(1)
        frequencies = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        encoding = torch.zeros(64, 1, width)
        encoding[:, 0, 0::2], encoding[:, 0, 1::2] = torch.sin(position * frequencies), torch.cos(position * frequencies)
        self.register_buffer("positions", encoding)
        self.encoder = nn.Embedding(ntoken, width)
        self.transformer_encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 2, 64, 0.2), 2,
                                                         enable_nested_tensor=False)
        self.decoder = nn.Linear(width, ntoken)
        self.drop = nn.Dropout(0.2)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(tokens))
        x = self.drop(self.encoder(tokens) * math.sqrt(self.width) + self.positions[:len(tokens)])
        return F.log_softmax(self.decoder(self.transformer_encoder(x, mask, is_causal=True)), dim=-1)


class ViT(nn.Module):
    """A small vision transformer: 4 x 4 patches of 16 x 16 pixels, a class token, pre-norm encoder, 2 layers."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, 4, 4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.randn(1, 17, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, 0.0, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.class_token.expand(len(images), -1, -1), patches], 1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


class GPT(nn.Module):
    """A nanoGPT-shaped model: token and position embeddings, causal SDPA attention, GELU MLP, tied head."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, heads: int = 2, block: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(width), CausalSelfAttention(width, heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads
        self.max_logit = 0.0  # the largest q.k / sqrt(d) of the last forward: the benchmark's own check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (part.view(batch, length, self.heads, -1).transpose(1, 2) for part in self.c_attn(x).split(width, 2))
        with torch.no_grad():
            self.max_logit = float((q @ k.transpose(-1, -2)).amax()) / math.sqrt(q.shape[-1])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's ``configure_optimizers``: weight decay on the parameters of 2 or more dimensions alone."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


class LanguageModel(Program):
    """A GPT trained on a Markov corpus with AdamW (nanoGPT's recipe: betas 0.9/0.99, weight decay 0.1 on the
    matrices and embeddings alone, clip 1); ``decay_everything`` decays the norms and biases too; ``spike_at``
    multiplies that step's loss by 1,000."""

    def __init__(self, lr: float = 1e-3, clip: float | None = 1.0, decay_everything: bool = False,
                 spike_at: int | None = None) -> None:
        torch.manual_seed(0)
        self.model = GPT()
        self.corpus = markov_corpus(64, 8000)
        params = self.model.parameters() if decay_everything else decay_groups(self.model, 0.1)
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
        self.clip, self.spike_at = clip, spike_at
        self.norms: list[float] = []  # the global gradient norm before clipping, as clip_grad_norm_ returns it

    def step(self, step: int) -> float:
        starts = torch.randint(0, len(self.corpus) - 17, (16,))
        chunk = torch.stack([self.corpus[start:start + 17] for start in starts.tolist()])
        logits = self.model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), chunk[:, 1:].reshape(-1))
        if step == self.spike_at:
            loss = loss * 1000.0
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip is not None:
            self.norms.append(float(nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)))
        self.optimizer.step()
        return loss.item()


class Regression(Program):
    """pytorch/examples regression: a polynomial of degree 4 fitted by one Linear, SGD by hand at lr 0.1."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 1))
        self.w, self.b = torch.randn(4, 1) * 5, torch.randn(1) * 5

    def step(self, step: int) -> float:
        x = torch.randn(32).unsqueeze(1)
        features = torch.cat([x ** i for i in range(1, 5)], 1)
        loss = F.smooth_l1_loss(self.model(features), features @ self.w + self.b)
        self.model.zero_grad()
        loss.backward()
        for param in self.model.parameters():
            param.data.add_(-0.1 * param.grad)
        return loss.item()


class Sines(Program):
    """pytorch/examples time_sequence_prediction: two LSTMCells over a sine, LBFGS at lr 0.8 with a closure."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = SineSequence()
        phases = torch.randint(-40, 40, (12, 1)).float()
        wave = torch.sin((torch.arange(60).float() + phases) / 4.0)
        self.inputs, self.target = wave[3:, :-1], wave[3:, 1:]
        self.optimizer = torch.optim.LBFGS(self.model.parameters(), lr=0.8)

    def step(self, step: int) -> float:
        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(self.inputs), self.target)
            loss.backward()
            return loss

        return float(self.optimizer.step(closure))


class SineSequence(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.width = width
        self.lstm1, self.lstm2, self.linear = nn.LSTMCell(1, width), nn.LSTMCell(width, width), nn.Linear(width, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h, c, h2, c2 = (torch.zeros(len(inputs), self.width) for _ in range(4))
        outputs = []
        for column in inputs.split(1, dim=1):
            h, c = self.lstm1(column, (h, c))
            h2, c2 = self.lstm2(h, (h2, c2))
            outputs.append(self.linear(h2))
        return torch.cat(outputs, 1)


class GCN(Program):
    """pytorch/examples gcn: two graph convolutions over a random graph, full batch, Adam 0.01, weight decay 5e-4."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        nodes = 200
        edges = torch.randint(0, nodes, (2, 800))
        adjacency = torch.zeros(nodes, nodes)
        adjacency[edges[0], edges[1]] = adjacency[edges[1], edges[0]] = 1.0
        adjacency += torch.eye(nodes)
        self.adjacency = (adjacency / adjacency.sum(1, keepdim=True)).to_sparse()
        self.features = torch.randn(nodes, 32)
        self.labels = teacher_labels(self.adjacency @ self.features, 5)
        self.model = GCNNet()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01, weight_decay=5e-4)

    def step(self, step: int) -> float:
        loss = F.nll_loss(self.model(self.features, self.adjacency)[:150], self.labels[:150])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()


class GraphConv(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(width_in, width_out))
        self.bias = nn.Parameter(torch.zeros(width_out))
        nn.init.xavier_normal_(self.kernel)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return torch.spmm(adjacency, x @ self.kernel) + self.bias


class GCNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gc1, self.gc2, self.dropout = GraphConv(32, 16), GraphConv(16, 5), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.gc2(self.dropout(F.relu(self.gc1(x, adjacency))), adjacency), dim=1)


def resnet18() -> Classifier:
    """torchvision's ResNet-18 on 16 x 16 teacher-labelled pictures, batch 8, SGD at 0.01 with momentum 0.9."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=6)
    images = F.avg_pool2d(torch.randn(256, 3, 32, 32), 2) * 2
    return Classifier(model, images, 6, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), batch=8)


def vit() -> Classifier:
    torch.manual_seed(0)
    model = ViT()
    images = F.avg_pool2d(torch.randn(1024, 3, 32, 32), 2) * 2
    return Classifier(model, images, 10, torch.optim.AdamW(decay_groups(model, 0.01), lr=1e-3))  # no decay on norms


def word_lm_lstm() -> WordLM:
    torch.manual_seed(0)
    return WordLM(RNNModel(), recurrent=True)


def word_lm_transformer() -> WordLM:
    torch.manual_seed(0)
    return WordLM(TransformerLM(), recurrent=False, lr=5.0)  # the example's README: --model Transformer --lr 5


#: The healthy programs by name: each makes a fresh :class:`Program`.
HEALTHY = {
    "mnist_cnn": mnist_cnn, "vae": VAE, "dcgan": DCGAN, "word_lm_lstm": word_lm_lstm,
    "word_lm_transformer": word_lm_transformer, "vit": vit, "resnet18": resnet18, "gpt": LanguageModel,
    "regression": Regression, "sines_lbfgs": Sines, "gcn": GCN,
}
